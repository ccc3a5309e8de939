package pgstore

// UUIDv7Time exposes the reader behind ProducerTimeFromKey to the tests (TestUUIDv7TimeOfKey).
var UUIDv7Time = uuidV7Time
