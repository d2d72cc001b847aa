"""Placement rules by op family, one file each; `passes.placement_rules`
assembles them into the table the place pass reads."""
