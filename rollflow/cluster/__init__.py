"""Ray plumbing with no ML: runtime start-up, worker groups, weight sync."""
