"""A discrete-event simulator of an edge fleet: real schedulers and placement on simulated time."""
