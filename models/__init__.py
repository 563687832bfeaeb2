"""The Flax encoder and Hugging Face checkpoint loading."""
