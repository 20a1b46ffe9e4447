"""Who may do what: tokens and their roles, request authorization, the audit log, TLS and the home's secret."""
