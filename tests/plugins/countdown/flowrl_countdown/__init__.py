"""Countdown: the model counts down from a number, one number per turn."""
