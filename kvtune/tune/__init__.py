"""The tuning job: run the notebooks (papermill), write report, recommendation and configs."""
