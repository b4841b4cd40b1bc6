"""The runtime: prompts, one decoding path for every command, and prefills shared by several methods."""
