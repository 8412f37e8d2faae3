"""The continual loop: one cycle per slot (dataset → train → eval → promote), drift on the fan-out slice."""
