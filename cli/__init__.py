"""memrecipe: memory-saving fine-tuning recipes for Hugging Face Accelerate.

The CLI lives in memrecipe.main; recipes/sft.py imports the training helpers from
memrecipe.data, memrecipe.modeling and memrecipe.measure. Importing this package imports no torch.
"""

import logging
import os
import warnings

__version__ = "0.1.0"

# Library notices that say nothing about a run: bitsandbytes' optional CPU 4-bit kernel, a
# peft/transformers deprecation, and torch's rename of collectives that DeepSpeed still calls.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated.*", category=FutureWarning)
# The profiler (the loss's memory is measured with it on CPU) announces every start and stop.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
