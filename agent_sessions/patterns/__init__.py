"""The loops a Spec can ask for. Each takes the transcript so far and returns a Result."""
