"""recur_core: the runtime for depth-recurrent (looped) transformers."""
from .model.checkpoint import Checkpoint, CheckpointError, save_checkpoint
from .model.config import ModelConfig
from .model.formats import describe_folder, load_checkpoint
from .model.looped_lm import LoopedLM

__all__ = ["Checkpoint", "CheckpointError", "LoopedLM", "ModelConfig", "describe_folder", "load_checkpoint",
           "save_checkpoint"]
