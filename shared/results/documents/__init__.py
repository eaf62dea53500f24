"""The files a run writes into its folder for every reader: results.json, leaderboard.json, their CSV views, and a
run over several models' own folder (built from the answer room, read by pages and exports)."""
