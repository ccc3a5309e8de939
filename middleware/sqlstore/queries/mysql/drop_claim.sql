-- Takes one member's claim out of a batch transaction.
DELETE FROM {{.Table}} WHERE {{template "key" .}}
