"""Task recipes: data preparation and reward functions that the example scripts and the CLI use."""
