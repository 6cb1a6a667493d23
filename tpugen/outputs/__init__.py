"""What a run leaves on disk: images with their parameters, the manifest, the grid and the report."""
