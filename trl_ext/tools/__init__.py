"""Tools that run before or after training, without a trainer: the memory planner (`memory`) and the `trl-ext`
command (`cli`)."""
