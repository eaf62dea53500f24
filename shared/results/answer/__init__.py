"""The run's answer and the statistics behind it: the leaderboard's CV-chosen layers, intervals and rankings, near
ties, tiers and sites, the learning curve and the cross-model table; words for the prober's verdicts. No file
format and no page: the rooms above render what these compute."""
