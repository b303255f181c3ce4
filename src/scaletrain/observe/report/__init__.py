"""What a run tells outside itself, from what the step ledger and the loop recorded.

- `html`: `scaletrain report RUN`, one self-contained page about where the time went.
- `trackers`: experiment trackers (TensorBoard, MLflow, a user's own).
"""

__all__: list[str] = []
