"""recur_core: the runtime for depth-recurrent (looped) transformers."""
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import ModelConfig
from .model import LoopedLM

__all__ = ["Checkpoint", "CheckpointError", "LoopedLM", "ModelConfig", "load_checkpoint", "save_checkpoint"]
