"""Models served through the megakernel."""
