"""Experiments: several `minite train` arms x seeds from one TOML file, launched side by side as
separate processes, compared in one report (`minite experiment`)."""

from minite.experiment.launch import launch, run_dir
from minite.experiment.report import write_report
from minite.experiment.spec import Arm, Experiment, load_experiment

__all__ = ["Arm", "Experiment", "launch", "load_experiment", "run_dir", "write_report"]
