"""What a person reads: the self-contained HTML report with its figures and tables, and the generated markdown
pages (findings, cross-model findings, contenders, steerability), every number read from a run's documents."""
