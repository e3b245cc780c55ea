"""What the command-line tools share in how they talk to the user: the help layout."""
