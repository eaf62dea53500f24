"""The capability stage in one room (application, below the API and the CLI): what steering a cell costs on an
lm-evaluation-harness task, scored through the run's own service (measure), written into the run's documents
(records), and run over every steered cell of a finished run (stage)."""
