package tests

import _ "github.com/watermill-inbox/watermill-inbox/adapters/all" // every broker name package router may be given
