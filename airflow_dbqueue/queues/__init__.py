"""The common-messaging queue provider (scheme ``dbqueue``) for MessageQueueTrigger and AssetWatcher."""
