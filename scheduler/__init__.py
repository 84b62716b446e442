"""``koda scheduler``: the central scheduler that turns due schedules into runs."""
