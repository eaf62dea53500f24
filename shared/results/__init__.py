"""results.json, the leaderboard, the HTML report and the submission format (application)."""
