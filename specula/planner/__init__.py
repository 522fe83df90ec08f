"""Hardware-aware planning: cost model, calibrated acceptance, tree sizing (ALGORITHMS.md §4)."""

from specula.planner.calibration import Calibrator, CalibrationConfig
from specula.planner.planner import HardwarePlanner, PlannerConfig
from specula.planner.select import chain_should_extend, choose_size, edge_scores, path_probabilities

__all__ = [
    "Calibrator", "CalibrationConfig", "HardwarePlanner", "PlannerConfig",
    "chain_should_extend", "choose_size", "edge_scores", "path_probabilities",
]
