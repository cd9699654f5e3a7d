"""Tests of mk.models: config, weights, the torch reference (against transformers), tokenizer."""
