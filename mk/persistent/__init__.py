"""The persistent runtime: task descriptors, event counters, megakernel generation."""
