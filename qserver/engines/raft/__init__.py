"""raft"""
