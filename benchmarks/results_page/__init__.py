"""The results page's parts: result files and formatting (``results``), one renderer per scenario
(``scenarios``), the README's highlights (``highlights``). The entry point is ``benchmarks/report_page.py``."""
