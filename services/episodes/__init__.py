"""The episode builder: judged traces become query-only episodes and replay tasks."""
