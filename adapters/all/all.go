// Package all registers every broker adapter of this module, for a program that picks its
// broker by configuration among all of them (the demo, the operator's CLI):
//
//	import _ "github.com/watermill-inbox/watermill-inbox/adapters/all"
//
// It links every broker client (the AWS SDK, sarama, NATS, go-redis, watermill-amqp,
// watermill-sql). A service that runs on one broker imports that adapter alone instead, e.g.
// _ "github.com/watermill-inbox/watermill-inbox/adapters/amqp" (docs/modules.md).
package all

import (
	_ "github.com/watermill-inbox/watermill-inbox/adapters/amqp"     // registers "amqp"
	_ "github.com/watermill-inbox/watermill-inbox/adapters/kafka"    // registers "kafka"
	_ "github.com/watermill-inbox/watermill-inbox/adapters/nats"     // registers "nats"
	_ "github.com/watermill-inbox/watermill-inbox/adapters/postgres" // registers "postgres"
	_ "github.com/watermill-inbox/watermill-inbox/adapters/redis"    // registers "redis"
	_ "github.com/watermill-inbox/watermill-inbox/adapters/sqs"      // registers "sqs"
)
