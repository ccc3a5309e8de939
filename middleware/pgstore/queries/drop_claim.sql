-- Takes one member's claim out of a batch transaction (after a rollback to its savepoint, or
-- in the optimistic design before the batch rolls back).
DELETE FROM {{.Table}}
WHERE {{template "key" .}}
