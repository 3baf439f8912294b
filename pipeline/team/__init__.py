"""A team's Prefect server: work pools and GPU slots (`pools`), `gptforge deploy` (`deploy`), approval gates
(`approval`) and the watched data (`watch`)."""
