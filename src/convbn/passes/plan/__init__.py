"""Planning for ``strategy="auto"``: the pure planner over what each layer keeps, and the glue that measures chains for it."""
