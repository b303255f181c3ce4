"""The errors scaletrain raises for problems a user can cause and fix.

Each message says what was received, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DatasetError",
    "EnvironmentDetectionError",
    "LaunchError",
    "ScaletrainError",
]


class ScaletrainError(RuntimeError):
    """Base class: a problem in the user's setup, reported as one clear paragraph."""


class ConfigError(ScaletrainError, ValueError):
    """A configuration value that cannot work (bad strategy, backend, flag...)."""


class EnvironmentDetectionError(ScaletrainError):
    """The cluster environment is recognised but unusable as it is."""


class DatasetError(ScaletrainError, FileNotFoundError):
    """A dataset directory is missing files or holds files in the wrong format."""


class LaunchError(ScaletrainError):
    """The launcher cannot start: port in use, unreachable endpoint, missing script."""


class CheckpointError(ScaletrainError):
    """A checkpoint that cannot be loaded: truncated, corrupted, foreign or mismatched."""
