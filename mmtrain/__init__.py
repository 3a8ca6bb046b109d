"""mmtrain: from raw text, images, video and audio to a trained GPT or vision-language model on many GPUs."""

__version__ = "0.1.0"
