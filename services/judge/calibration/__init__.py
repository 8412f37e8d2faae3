"""Calibrating the judge against human labels: agreement metrics, qrels-derived grades, hand rankings."""
