"""The judge worker: grades stored traces blind, offline, and publishes verdicts."""
