"""What a run shows while it trains and after: the metrics (`diagnostics`), the alarms on PPO's failure modes
(`alarms`), the run folder (`callbacks`), the progress bar (`progress`) and the dashboard (`report`, which loads
neither torch nor trl)."""
