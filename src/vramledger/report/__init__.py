"""Terminal tables, JSON, plots, HTML: the only place that formats or prints."""
