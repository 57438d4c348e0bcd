"""kvtrail's dashboard: Streamlit views of the fleet, findings, affected responses, exposure, transfers
and the disclosure report, read-only, on a store file or a running service (``kvtrail dashboard``)."""
