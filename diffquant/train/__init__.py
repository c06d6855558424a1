"""Training the zoo: deterministic data, AdamW with warmup and cosine decay, checkpoints and resume."""

from diffquant.train.trainer import TrainConfig, lr_at, train

__all__ = ["TrainConfig", "lr_at", "train"]
