"""Prompt data: the three prompt forms and their left-padding collator (`prompts`), and the order rollout batches
take them in (`batches`)."""
