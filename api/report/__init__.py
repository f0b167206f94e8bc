"""`spectune report`: one self-contained HTML file explaining a study, with its plots embedded."""

from api.report.render import Report, build_report
from api.report.source import ReportSourceError, StudyData, load_from_api, load_from_database

__all__ = ["Report", "ReportSourceError", "StudyData", "build_report", "load_from_api", "load_from_database"]
