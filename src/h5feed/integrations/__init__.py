"""h5feed stores served to other projects' own training commands, through the plugin interfaces they offer."""
