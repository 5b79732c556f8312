"""memrecipe: memory-saving fine-tuning recipes for Hugging Face Accelerate.

The CLI lives in memrecipe.main; recipes/sft.py imports the training helpers from
memrecipe.training. Importing this package imports no torch.
"""

__version__ = "0.1.0"
