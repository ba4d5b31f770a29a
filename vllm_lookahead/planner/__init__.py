"""What each request drafts this step: the planner, its cost curve and acceptance estimates."""
