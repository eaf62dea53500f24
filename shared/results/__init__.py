"""What a finished run says, in rooms by job (application): answer/ (the answer and the statistics behind it),
documents/ (the run folder's results.json, leaderboard.json and tables), pages/ (the HTML report and the generated
markdown pages a person reads), exports/ (the run in other projects' formats: submissions, vectors, trackers)."""
