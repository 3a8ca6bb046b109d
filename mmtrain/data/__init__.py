"""Datasets and loaders: indexed token files, GPT samples, blends, multimodal (energon) loading."""
