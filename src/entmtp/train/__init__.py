"""Training Medusa and Hydra heads by self-distillation: data (``data``), the training loop (``trainer``),
the evaluation report (``evaluate``), and ``train_heads`` plus the CLI commands (``pipeline``)."""

from .data import GenSettings, generate_data, load_split, load_training_prompts
from .evaluate import evaluate_heads, plot_learning_curve, write_report
from .pipeline import add_eval_arguments, add_train_arguments, run_eval, run_train, train_heads
from .trainer import TrainSettings, train

__all__ = [
    "GenSettings",
    "TrainSettings",
    "add_eval_arguments",
    "add_train_arguments",
    "evaluate_heads",
    "generate_data",
    "load_split",
    "load_training_prompts",
    "plot_learning_curve",
    "run_eval",
    "run_train",
    "train",
    "train_heads",
    "write_report",
]
