"""Tools that run before or after training, without a trainer: the memory planner (`memory`), its live-tensor-bytes
counter for checking it against the real trainer (`live_memory`) and the `trl-ext` command (`cli`)."""
