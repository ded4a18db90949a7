"""Training Medusa and Hydra heads by self-distillation: the training prompts (``prompt_sources``), the
distillation shards made from them (``shards``), the training loop (``trainer``), the evaluation report
(``evaluate``), ``train_heads`` with its settings (``pipeline``), and the two CLI commands (``command``)."""

from .command import add_eval_arguments, add_train_arguments, run_eval, run_train
from .evaluate import evaluate_heads, plot_learning_curve, write_report
from .pipeline import EvalSettings, HeadsSettings, TrainJob, train_heads
from .prompt_sources import load_training_prompts
from .shards import GenSettings, generate_data, load_split
from .trainer import TrainSettings, train

__all__ = [
    "EvalSettings",
    "GenSettings",
    "HeadsSettings",
    "TrainJob",
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
