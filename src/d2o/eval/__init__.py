"""Evaluation: tasks on real data, metrics, and sweeps that share one prefill among methods."""
